"""From logits to tokens: logits processing (penalties, bias, min_tokens), the sampler, structured
output's grammars and bitmask, and pooling for embeddings."""
