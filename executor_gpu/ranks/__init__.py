"""Tensor parallelism across processes: rank 0's group of followers (group.py) and the model
as rank 0 sees it, every call mirrored on the followers (leader_model.py)."""
