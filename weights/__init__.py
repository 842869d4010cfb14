"""twice.weights"""
