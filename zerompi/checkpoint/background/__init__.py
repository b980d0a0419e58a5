"""Asynchronous saves: what runs beside training while a checkpoint is written.

saver.py     AsyncSaver: begin (snapshot), poll/flush (advance, publish), one per engine
snapshot.py  the host staging buffer and the Snapshot copied into it
writers.py   where the bytes are written: a thread, or the rank's helper process
helper.py    that helper process (`python -m zerompi.checkpoint.background.helper`)

Nothing is imported here: the helper process imports only numpy and h5py.
"""
