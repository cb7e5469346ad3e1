"""`veloxquant tune`: search recipe parameters for the lowest measured perplexity within a byte budget."""
