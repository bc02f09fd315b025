"""Backend setup and model loading."""
