"""lockserve.offload"""
