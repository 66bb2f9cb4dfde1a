"""The controller: runs inside the job's allocation, launches and drains worker steps, serves the API."""
