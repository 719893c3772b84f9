"""lockserve.configs"""
