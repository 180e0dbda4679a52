"""Data phase: download the WMT archives, clean pairs to Parquet, train the shared SentencePiece
vocabulary, encode ids to shards. Imports the pipeline core (storage, stage, config, ray_env) only."""
