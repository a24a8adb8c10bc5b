"""The Hugging Face wing: the mapping between our model and transformers' Llama (`mapping`), loading
from the Hub or a local export (`hub`), and exporting a checkpoint (`export`)."""
