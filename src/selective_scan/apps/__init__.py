"""Runnable programs built on the library, apart from its operators: the selective-copying main
job (``python -m selective_scan.apps.copying``) and the operator demo
(``python -m selective_scan.apps.demo``)."""
