"""unbroken.agent"""
