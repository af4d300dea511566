"""Starting a deployment: ``stride serve`` (the launcher, which starts and watches every process) and the
``stride`` command line that routes to each subcommand."""
