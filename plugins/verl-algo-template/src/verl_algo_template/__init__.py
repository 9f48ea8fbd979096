"""A template verl algorithm plugin; the algorithm itself is in :mod:`verl_algo_template.my_algo`.

Keep this file free of heavy imports: verl imports the package only when ``my_algo`` is selected.
"""
