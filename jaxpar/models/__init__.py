"""Model families and what is computed from their shapes: the family interface and the one model
class (family.py), GPT-2 and Llama, their shared layers and attention, the KV-cache decode, and
FLOPs per token. Models name logical axes only.
May import: jaxpar.core.
"""
