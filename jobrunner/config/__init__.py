"""The job's configuration: typed sections, their values, and the command line's options."""
