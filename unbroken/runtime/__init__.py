"""unbroken.runtime"""
