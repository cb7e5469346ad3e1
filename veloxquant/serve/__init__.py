"""`veloxquant serve`: a recipe's caches behind mlx-lm's OpenAI-compatible server."""
