"""Planning estimates: memory per rank, communication time, bucket sizes."""
