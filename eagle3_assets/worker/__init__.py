"""Code that runs on the GPU host. Never imports dagster; talks to it only through dagster-pipes."""
