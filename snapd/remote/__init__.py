"""The remote tier: committed snapshots replicated to object storage (docs/remote.md).

``layout.py`` is where things are in a remote root and the commit rule; the daemon's
uploader, remote retention, and the readers (restore on a new node, the commands on
remote URLs, ``snapd pull``) build on it. fsspec reaches the store: ``s3://`` through
s3fs, ``file://`` for a mounted shared filesystem, any other fsspec protocol as is.
Credentials come from the environment (AWS variables, fsspec configuration) and are
never written anywhere snapd writes.
"""
