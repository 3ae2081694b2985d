"""What users meet first: the logbook, Colab, preflight, the site, the workshop, the exercises."""
