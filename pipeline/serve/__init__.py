"""Use the trained model: export (Hugging Face Marian folder, CTranslate2 models), register (the MLflow
Model Registry version) and the Ray Serve app. May import the pipeline core, pipeline.evaluate
(translate's engines, score's setup) and model/; nothing imports it but the DAG table."""
