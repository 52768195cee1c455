"""The OpenAI batch format: request lines in, response and error lines out."""
