"""What stands beside the library: the ``zeroshard`` command, its plots, the demo and the test harness."""
