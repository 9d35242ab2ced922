# Cython declarations of heads.py (pure-Python mode: the .py is the source;
# read only by the build).
from .request cimport Request
