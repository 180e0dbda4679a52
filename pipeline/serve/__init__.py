"""Use the trained model: export (Hugging Face Marian folder, CTranslate2 models) and the Ray Serve app.
May import the pipeline core, pipeline.evaluate (translate's engines) and model/; nothing imports it but the DAG table."""
