"""lockserve.kernels.triton"""
