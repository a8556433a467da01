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
#include <string.h>

#define MAX_KEPT 32 /* depth + via, at most: callsite passes 4 + 3 */
#define MEMO 1024     /* chains remembered in C (a power of two) */

/* The memo: chains found in the Python cache before, so that a chain seen again is
 * answered without building its key (two ints a kept frame, a tuple, its hash: most
 * of a lookup's ~1.4 us). Each entry holds its code objects and its site: a pointer
 * compared here always names a live code object, never a later one at the same
 * address. ``clear()`` empties it wherever callsite forgets its cache. */
typedef struct {
    int n; /* kept frames; 0: empty slot */
    PyObject *codes[MAX_KEPT];
    int lastis[MAX_KEPT];
    PyObject *site;
} Entry;

static Entry memo[MEMO];

static void
forget(Entry *e)
{
    for (int i = 0; i < e->n; i++)
        Py_DECREF(e->codes[i]);
    Py_CLEAR(e->site);
    e->n = 0;
}

static size_t
slot_of(PyObject **codes, const int *lastis, int n)
{
    size_t h = (size_t)n;
    for (int i = 0; i < n; i++) {
        h = (h ^ ((size_t)codes[i] >> 4)) * (size_t)0x9E3779B97F4A7C15ULL;
        h = (h ^ (size_t)lastis[i]) * (size_t)0xBF58476D1CE4E5B9ULL;
    }
    return (h ^ (h >> 29)) & (MEMO - 1);
}

/* lookup(frame, kinds, cache, depth, via, unknown) -> CallSite | None
 *   kinds: {code file name: 0 user, 1 library, 2 skip}; cache: {key tuple: CallSite}.
 *   The key is callsite._walk's: (id(code), f_lasti) of each kept frame, innermost first.
 *   Returns the cached site, ``unknown`` when no frame is kept, None otherwise. */
static PyObject *
lookup(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "lookup takes 6 arguments");
        return NULL;
    }
    PyObject *frame_arg = args[0], *kinds = args[1], *cache = args[2], *unknown = args[5];
    if (!PyDict_Check(kinds) || !PyDict_Check(cache)) {
        PyErr_SetString(PyExc_TypeError, "lookup: kinds and cache must be dicts");
        return NULL;
    }
    long depth = PyLong_AsLong(args[3]), most_via = PyLong_AsLong(args[4]);
    if ((depth == -1 || most_via == -1) && PyErr_Occurred())
        return NULL;
#if PY_VERSION_HEX < 0x030B0000
    Py_RETURN_NONE; /* PyFrame_GetLasti is 3.11+: the Python walk serves 3.10 */
#else
    if (!PyFrame_Check(frame_arg))
        Py_RETURN_NONE;
    if (depth + most_via > MAX_KEPT || depth <= 0 || most_via < 0)
        Py_RETURN_NONE;
    PyObject *codes[MAX_KEPT];
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
            codes[kept] = (PyObject *)code;
            lastis[kept++] = PyFrame_GetLasti(frame);
            users++;
        } else if (kind == 1 && users == 0 && via < most_via) {
            codes[kept] = (PyObject *)code;
            lastis[kept++] = PyFrame_GetLasti(frame);
            via++;
        }
        /* the frame holds its code: the pointer stays valid while we need it */
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
    Entry *e = &memo[slot_of(codes, lastis, kept)];
    if (e->n == kept && memcmp(e->codes, codes, kept * sizeof(PyObject *)) == 0
            && memcmp(e->lastis, lastis, kept * sizeof(int)) == 0) {
        Py_INCREF(e->site);
        return e->site;
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
    /* remembered: the entry's references first, then the old one's dropped (its
     * decrefs may run arbitrary code; the slot is consistent by then) */
    Entry old = *e;
    for (int i = 0; i < kept; i++) {
        Py_INCREF(codes[i]);
        e->codes[i] = codes[i];
        e->lastis[i] = lastis[i];
    }
    Py_INCREF(site);
    e->site = site;
    e->n = kept;
    forget(&old);
    Py_INCREF(site);
    return site;
#endif
}

static PyObject *
clear(PyObject *self, PyObject *unused)
{
    for (int i = 0; i < MEMO; i++) {
        Entry old = memo[i];
        memo[i].n = 0;
        memo[i].site = NULL;
        forget(&old);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"lookup", (PyCFunction)(void (*)(void))lookup, METH_FASTCALL,
     "lookup(frame, kinds, cache, depth, via, unknown): the cached call site of the walk "
     "from frame, unknown when no frame is kept, None when the Python walk must run"},
    {"clear", clear, METH_NOARGS,
     "clear(): forget the chains remembered in C (callsite forgot its cache)"},
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
