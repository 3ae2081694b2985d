"""What a run needs and costs: parameter memory, the AOT plan, predictions, the serving benchmark, prices."""
