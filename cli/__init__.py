"""twice.cli"""
