"""The device-agnostic torch parts every torch executor shares: the model families,
paged attention (torch reference and the backend registry), the persistent input batch,
batched sampling and the shared model runner."""
