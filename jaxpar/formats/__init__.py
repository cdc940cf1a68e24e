"""Hugging Face's file formats, for any family: safetensors read by memory map, config.json and the
weight files read and written, and the one-table mapping a family's adapter declares its weights by.
May import: jaxpar.core, jaxpar.nn.
"""
