"""Reference solutions of the workbook's exercises, one module each.

They are not shown in the notebook; :func:`moekit.workbook.show_solution` prints one on purpose,
and :func:`moekit.workbook.solution` returns it (the workbook's ``use_solutions`` parameter).
"""
