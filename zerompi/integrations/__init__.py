"""Bridges users expect: DeepSpeed's initialize contract (initialize.py), a torch.distributed
group from the MPI world (distributed.py), each rank's share of a dataset (data.py), the
Hugging Face Trainer (transformers.py). Imported on demand: `import zerompi` stays cheap."""
