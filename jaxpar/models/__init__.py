"""Model families and what is computed from their shapes: the GPT model with its stacked layers,
attention, the KV-cache decode, and FLOPs per token. Models name logical axes only.
May import: jaxpar.core.
"""
