"""What is trained on the data path: one Task per workload (fastload/tasks/base.py)."""
