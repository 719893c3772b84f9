"""lockserve.cluster"""
