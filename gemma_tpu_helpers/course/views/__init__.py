"""Tables and plots of the fixes' results, for the notebooks."""
