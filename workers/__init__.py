"""lockserve.workers"""
