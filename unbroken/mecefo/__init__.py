"""unbroken.mecefo"""
