"""The Transformer LM from the first assignment, as studied by cs336-systems."""
