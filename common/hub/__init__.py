"""Model sources: a `--model` reference (a local directory or a Hugging Face Hub id) resolved
to a local checkpoint directory holding the files its reader needs, with clear errors.

Torch-free: the controller, every executor and the simulator resolve their model here
(common.hub.resolve), fetching through huggingface_hub only what they read
(common.hub.files).
"""
