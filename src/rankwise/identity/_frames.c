/* The hot half of rankwise.identity.callsite.capture, in C: the frame walk and the cache
 * lookup of a call site seen before. Optional: callsite.py has the same walk in Python
 * and uses it when this module is missing (no compiler at install time) or says
 * "not here" (None): a frame of a file not yet classified, or a chain not cached yet.
 * Why C: the walk is ~0.15 us per frame in Python, ~2 us per call for a stack of 8-10
 * frames, the largest single part of a small device collective's Python
 * (docs/gpu.md, "The proxy"). The rules are callsite._walk's; keep the two the same. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>

#define MAX_KEPT 32 /* depth + via, at most: callsite passes 4 + 3 */

/* lookup(frame, kinds, cache, depth, via, unknown) -> CallSite | None
 *   kinds: {code file name: 0 user, 1 library, 2 skip}; cache: {key tuple: CallSite}.
 *   The key is callsite._walk's: (id(code), f_lasti) of each kept frame, innermost first.
 *   Returns the cached site, ``unknown`` when no frame is kept, None otherwise. */
static PyObject *
lookup(PyObject *self, PyObject *args)
{
    PyObject *frame_arg, *kinds, *cache, *unknown;
    int depth, most_via;
    if (!PyArg_ParseTuple(args, "OO!O!iiO", &frame_arg, &PyDict_Type, &kinds, &PyDict_Type,
                          &cache, &depth, &most_via, &unknown))
        return NULL;
#if PY_VERSION_HEX < 0x030B0000
    Py_RETURN_NONE; /* PyFrame_GetLasti is 3.11+: the Python walk serves 3.10 */
#else
    if (!PyFrame_Check(frame_arg))
        Py_RETURN_NONE;
    if (depth + most_via > MAX_KEPT || depth <= 0 || most_via < 0)
        Py_RETURN_NONE;
    void *codes[MAX_KEPT];
    int lastis[MAX_KEPT];
    int kept = 0, users = 0, via = 0;
    PyFrameObject *frame = (PyFrameObject *)frame_arg;
    Py_INCREF(frame);
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame); /* new reference */
        PyObject *kind_obj = PyDict_GetItemWithError(kinds, code->co_filename);
        if (kind_obj == NULL) {
            Py_DECREF(code);
            Py_DECREF(frame);
            if (PyErr_Occurred())
                return NULL;
            Py_RETURN_NONE; /* not classified yet: the Python walk does it */
        }
        long kind = PyLong_AsLong(kind_obj);
        if (kind == 0) {
            codes[kept] = code;
            lastis[kept++] = PyFrame_GetLasti(frame);
            users++;
        } else if (kind == 1 && users == 0 && via < most_via) {
            codes[kept] = code;
            lastis[kept++] = PyFrame_GetLasti(frame);
            via++;
        }
        /* the cache keeps every kept code object alive (callsite._alive), and this
         * frame holds its own: the pointer stays valid as long as we need it */
        Py_DECREF(code);
        if (users == depth) {
            Py_DECREF(frame);
            break;
        }
        PyFrameObject *back = PyFrame_GetBack(frame); /* new reference or NULL */
        Py_DECREF(frame);
        frame = back;
    }
    if (kept == 0) {
        Py_INCREF(unknown);
        return unknown;
    }
    PyObject *key = PyTuple_New(2 * kept);
    if (key == NULL)
        return NULL;
    for (int i = 0; i < kept; i++) {
        PyObject *id = PyLong_FromVoidPtr(codes[i]);
        PyObject *lasti = PyLong_FromLong(lastis[i]);
        if (id == NULL || lasti == NULL) {
            Py_XDECREF(id);
            Py_XDECREF(lasti);
            Py_DECREF(key);
            return NULL;
        }
        PyTuple_SET_ITEM(key, 2 * i, id);
        PyTuple_SET_ITEM(key, 2 * i + 1, lasti);
    }
    PyObject *site = PyDict_GetItemWithError(cache, key); /* borrowed */
    Py_DECREF(key);
    if (site == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(site);
    return site;
#endif
}

static PyMethodDef methods[] = {
    {"lookup", lookup, METH_VARARGS,
     "lookup(frame, kinds, cache, depth, via, unknown): the cached call site of the walk "
     "from frame, unknown when no frame is kept, None when the Python walk must run"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_frames",
    "The call-site frame walk in C (optional; see rankwise.identity.callsite).", -1, methods,
};

PyMODINIT_FUNC
PyInit__frames(void)
{
    return PyModule_Create(&module);
}
