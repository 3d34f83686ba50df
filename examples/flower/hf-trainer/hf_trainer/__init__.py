"""Flower FedAvg of a tiny causal LM; each client trains with Hugging Face Trainer (DDP) on a rankexec rank group."""
