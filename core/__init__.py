"""twice.core"""
