"""unbroken.snapshot"""
