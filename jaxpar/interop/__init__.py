"""Other programs' formats: Hugging Face configs and safetensors weights, in and out.
May import: jaxpar.core, jaxpar.models, jaxpar.data.
"""
