"""guidance"""
