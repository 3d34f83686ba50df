"""Flower FedAvg on scikit-learn's digits; each client trains with DDP on a rankexec rank group."""
