"""Build step: makes `import pandas` stop doing work a DataFrame and a plot never use.

Run once at image build, as root, before the bytecode of the edited files is made again.
Each edit names the exact text it replaces and fails the build when that text is not
there (another Debian release of pandas or pytz), so an edit never half-applies.

- pytz (Debian's, on the system zoneinfo) lists every zone at import, opening each of
  ~600 files to check its header: 37 ms of CPU in every `import pandas`. The lists become
  pytz's own LazyList/LazySet, filled when first read.
- pandas 1.5 imports pyarrow (and pyarrow.compute) at import because it is installed:
  60-70 ms of CPU. pandas reads pyarrow's version from its `_generated_version.py`
  instead, and the Arrow-backed arrays load with their first use
  (`pd.arrays.ArrowExtensionArray`, `string[pyarrow]`, `read_parquet`).
- pandas' test helpers import `socket` (its enums: about 15 ms) for one tuple of network
  errors; it is imported when that tuple is made.
- matplotlib registers the geographic projections and mplot3d's Axes3D at import (about
  25 ms); they are imported the first time a figure asks for `projection="3d"` (or
  "aitoff", "hammer", "lambert", "mollweide"), or when code imports them itself.

The kernel tests (`test_pandas_loads_pyarrow_when_used`) check the result in the image.
"""

import importlib.util
import os
import py_compile
import sys

import pandas
import pytz

PANDAS = os.path.dirname(pandas.__file__)
PYTZ = os.path.dirname(pytz.__file__)
# Found without importing it: matplotlib's import reads the font cache and rc files.
MATPLOTLIB = os.path.dirname(importlib.util.find_spec("matplotlib").origin)


def edit(path, old, new):
    with open(path) as f:
        text = f.read()
    if text.count(old) != 1:
        sys.exit("lazy-imports: %s does not hold the text to replace:\n%s" % (path, old))
    with open(path, "w") as f:
        f.write(text.replace(old, new))
    # The bytecode Debian compiled is stale now, and the root is read-only at run time.
    py_compile.compile(path, doraise=True, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)


LAZY_GETATTR = '''

def __getattr__(name):
    # codebroker: the Arrow-backed arrays load pyarrow; they load on first use.
    if name == "ArrowExtensionArray":
        from pandas.core.arrays.arrow.array import ArrowExtensionArray

        return ArrowExtensionArray
    if name == "ArrowStringArray":
        from pandas.core.arrays.string_arrow import ArrowStringArray

        return ArrowStringArray
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def __dir__():
    return sorted(set(globals()) | {"ArrowExtensionArray", "ArrowStringArray"})
'''

edit(
    os.path.join(PYTZ, "__init__.py"),
    """all_timezones_set = zoneinfo.available_timezones() - {"Factory", "localtime"}
common_timezones_set = (_read_timezones_from_zone_tab() | _extra_common_timezones_set) & all_timezones_set

all_timezones = sorted(all_timezones_set)
common_timezones = sorted(common_timezones_set)
""",
    """# codebroker: listing the zones opens every zone file; done when first read.
from pytz.lazy import LazyList as _LazyList, LazySet as _LazySet


_zone_names = []


def _all_zone_names():
    if not _zone_names:
        _zone_names.append(frozenset(zoneinfo.available_timezones() - {"Factory", "localtime"}))
    return _zone_names[0]


def _all_zones():
    yield from sorted(_all_zone_names())


def _common_zones():
    yield from sorted((_read_timezones_from_zone_tab() | _extra_common_timezones_set) & _all_zone_names())


all_timezones = _LazyList(_all_zones())
all_timezones_set = _LazySet(_all_zones())
common_timezones = _LazyList(_common_zones())
common_timezones_set = _LazySet(_common_zones())
""",
)

edit(
    os.path.join(PANDAS, "compat", "pyarrow.py"),
    """try:
    import pyarrow as pa

    _pa_version = pa.__version__
""",
    """

def _installed_pyarrow_version():
    # codebroker: pyarrow's version without importing it (60-70 ms); ImportError as
    # when it is missing.
    import importlib.util
    import os
    import re

    spec = importlib.util.find_spec("pyarrow")
    for path in (spec and spec.submodule_search_locations) or ():
        try:
            with open(os.path.join(path, "_generated_version.py")) as f:
                found = re.search(r"__version__ = version = '([^']+)'", f.read())
        except OSError:
            continue
        if found:
            return found.group(1)
    raise ImportError("pyarrow is not installed")


try:
    _pa_version = _installed_pyarrow_version()
""",
)

edit(
    os.path.join(PANDAS, "core", "arrays", "arrow", "dtype.py"),
    """if not pa_version_under1p01:
    import pyarrow as pa
""",
    """if not pa_version_under1p01:

    class _Pyarrow:
        # codebroker: pyarrow, imported when an ArrowDtype first needs it.
        def __getattr__(self, name):
            import pyarrow

            return getattr(pyarrow, name)

    pa = _Pyarrow()
""",
)

edit(
    os.path.join(PANDAS, "core", "arrays", "arrow", "__init__.py"),
    """from pandas.core.arrays.arrow.array import ArrowExtensionArray
from pandas.core.arrays.arrow.dtype import ArrowDtype
""",
    """from pandas.core.arrays.arrow.dtype import ArrowDtype
""" + LAZY_GETATTR,
)

edit(
    os.path.join(PANDAS, "core", "arrays", "__init__.py"),
    "from pandas.core.arrays.arrow import ArrowExtensionArray\n",
    "",
)
edit(
    os.path.join(PANDAS, "core", "arrays", "__init__.py"),
    "from pandas.core.arrays.string_arrow import ArrowStringArray\n",
    "",
)
edit(
    os.path.join(PANDAS, "core", "arrays", "__init__.py"),
    '''    "TimedeltaArray",
]
''',
    '''    "TimedeltaArray",
]
''' + LAZY_GETATTR,
)

edit(
    os.path.join(PANDAS, "arrays", "__init__.py"),
    """from pandas.core.arrays import (
    ArrowExtensionArray,
    ArrowStringArray,
    BooleanArray,
""",
    """from pandas.core.arrays import (
    BooleanArray,
""",
)
edit(
    os.path.join(PANDAS, "arrays", "__init__.py"),
    '''    "TimedeltaArray",
]
''',
    '''    "TimedeltaArray",
]
''' + LAZY_GETATTR,
)

# pandas.testing (imported by pandas) loads pandas._testing, whose lists of Arrow dtypes
# for pandas' own test suite are made with pyarrow at import: they are made on first use.
edit(
    os.path.join(PANDAS, "_testing", "__init__.py"),
    """if not pa_version_under1p01:
    import pyarrow as pa
""",
    """def _pyarrow_dtypes():
    # codebroker: made on first use, as they import pyarrow.
    import pyarrow as pa
""",
)
edit(
    os.path.join(PANDAS, "_testing", "__init__.py"),
    """        + BOOL_PYARROW_DTYPES
    )


EMPTY_STRING_PATTERN""",
    """        + BOOL_PYARROW_DTYPES
    )
    return {k: v for k, v in locals().items() if k.endswith("_PYARROW_DTYPES")}


def __getattr__(name):
    if name.endswith("_PYARROW_DTYPES") and not pa_version_under1p01:
        made = _pyarrow_dtypes()
        globals().update(made)
        if name in made:
            return made[name]
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


EMPTY_STRING_PATTERN""",
)
edit(
    os.path.join(PANDAS, "_testing", "_io.py"),
    "import io\nimport socket\nimport tarfile\n",
    "import io\nimport tarfile\n",
)
edit(
    os.path.join(PANDAS, "_testing", "_io.py"),
    "    import http.client\n    import urllib.error\n",
    "    import http.client\n    import socket\n    import urllib.error\n",
)
edit(
    os.path.join(MATPLOTLIB, "projections", "__init__.py"),
    """from .geo import AitoffAxes, HammerAxes, LambertAxes, MollweideAxes
from .polar import PolarAxes
from mpl_toolkits.mplot3d import Axes3D
""",
    """from .polar import PolarAxes

# codebroker: projections registered by name, imported the first time one is asked for.
_LAZY_PROJECTIONS = {
    "aitoff": ("matplotlib.projections.geo", "AitoffAxes"),
    "hammer": ("matplotlib.projections.geo", "HammerAxes"),
    "lambert": ("matplotlib.projections.geo", "LambertAxes"),
    "mollweide": ("matplotlib.projections.geo", "MollweideAxes"),
    "3d": ("mpl_toolkits.mplot3d", "Axes3D"),
}


def __getattr__(name):
    import importlib

    if name == "geo":
        return importlib.import_module("matplotlib.projections.geo")
    for module, attr in _LAZY_PROJECTIONS.values():
        if attr == name:
            return getattr(importlib.import_module(module), attr)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def __dir__():
    return sorted(set(globals()) | {"geo"} | {attr for _, attr in _LAZY_PROJECTIONS.values()})
""",
)
edit(
    os.path.join(MATPLOTLIB, "projections", "__init__.py"),
    """    def get_projection_class(self, name):
        \"\"\"Get a projection class from its *name*.\"\"\"
        return self._all_projection_types[name]

    def get_projection_names(self):
        \"\"\"Return the names of all projections currently registered.\"\"\"
        return sorted(self._all_projection_types)
""",
    """    def get_projection_class(self, name):
        \"\"\"Get a projection class from its *name*.\"\"\"
        if name not in self._all_projection_types and name in _LAZY_PROJECTIONS:
            import importlib

            module, attr = _LAZY_PROJECTIONS[name]
            self.register(getattr(importlib.import_module(module), attr))
        return self._all_projection_types[name]

    def get_projection_names(self):
        \"\"\"Return the names of all projections currently registered.\"\"\"
        return sorted(set(self._all_projection_types) | set(_LAZY_PROJECTIONS))
""",
)
edit(
    os.path.join(MATPLOTLIB, "projections", "__init__.py"),
    """projection_registry.register(
    axes.Axes,
    PolarAxes,
    AitoffAxes,
    HammerAxes,
    LambertAxes,
    MollweideAxes,
    Axes3D,
)
""",
    """projection_registry.register(
    axes.Axes,
    PolarAxes,
)
""",
)
