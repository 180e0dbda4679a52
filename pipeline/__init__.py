"""The data, training and evaluation stages of the Transformer-base reproduction DAG."""
