"""Planning estimates: memory per rank, communication time, bucket sizes (issue 17)."""
