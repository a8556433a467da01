/* rankwise's one optional C module: two self-contained parts, each deriving what it
 * needs from the objects it is handed and answering "let Python decide" otherwise.
 * Nothing here reads or writes a Python object's __dict__ or a module's globals.
 *   1. maker: slots dataclasses made without their Python __init__ (rankwise.slots)
 *   2. lookup, clear: the call-site frame walk (rankwise.identity.callsite)
 * Without a compiler the install goes on and the Python code serves (same results). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <structmember.h>

/* ---- 1. slots ------------------------------------------------------------------------ */

/* Making an instance of a slots dataclass without running its Python __init__: the hot
 * half of rankwise.slots.fast_new. Optional: without it fast_new returns the class
 * itself, whose generated __init__ stores the same values in the same slots.
 * Why C: a device collective makes two such records per call (its Call and the book's
 * Pending), and a generated __init__ of 11-19 fields is ~0.5 us of Python each, about a
 * fifth of rankwise's own time on a small NCCL call (docs/gpu.md, "The proxy").
 *
 * maker(cls, names, defaults) checks once that each name is a writable object slot of cls
 * (a member descriptor: slots live at fixed offsets in the instance) and keeps the
 * offsets; calling the maker with the first k values allocates the instance (the class's
 * tp_alloc: zeroed, tracked by the GC) and stores the k values, then the defaults of the
 * rest. A call with keywords is handed to the class itself. */


typedef struct {
    PyObject_VAR_HEAD
    vectorcallfunc vectorcall;
    PyTypeObject *cls;    /* strong */
    PyObject *defaults;   /* strong: a tuple, one per slot; `required` where none */
    PyObject *required;   /* strong: the marker of a value without a default */
    Py_ssize_t n;         /* slots filled */
    Py_ssize_t least;     /* values a call must give (the slots before the first default) */
    Py_ssize_t offsets[]; /* n of them */
} Maker;

static PyTypeObject Maker_Type;

static PyObject *
maker_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Maker *m = (Maker *)self;
    Py_ssize_t given = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0)
        return PyObject_Vectorcall((PyObject *)m->cls, args, nargsf, kwnames);
    if (given < m->least || given > m->n)
        /* the class's own __init__ raises its own TypeError for it */
        return PyObject_Vectorcall((PyObject *)m->cls, args, nargsf, NULL);
    PyObject *obj = m->cls->tp_alloc(m->cls, 0);
    if (obj == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < m->n; i++) {
        PyObject *v = i < given ? args[i] : PyTuple_GET_ITEM(m->defaults, i);
        Py_INCREF(v);
        *(PyObject **)((char *)obj + m->offsets[i]) = v;
    }
    return obj;
}

static int
maker_traverse(PyObject *self, visitproc visit, void *arg)
{
    Maker *m = (Maker *)self;
    Py_VISIT(m->cls);
    Py_VISIT(m->defaults);
    Py_VISIT(m->required);
    return 0;
}

static int
maker_clear(PyObject *self)
{
    Maker *m = (Maker *)self;
    Py_CLEAR(m->cls);
    Py_CLEAR(m->defaults);
    Py_CLEAR(m->required);
    return 0;
}

static void
maker_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    maker_clear(self);
    PyObject_GC_Del(self);
}

static PyObject *
maker_repr(PyObject *self)
{
    return PyUnicode_FromFormat("<fast_new of %s>", ((Maker *)self)->cls->tp_name);
}

/* The offset of slot `name` of `cls`; -1 with an exception set where it is none. */
static Py_ssize_t
slot_offset(PyTypeObject *cls, PyObject *name)
{
    if (!PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "maker: slot names must be str");
        return -1;
    }
    PyObject *descr = _PyType_Lookup(cls, name); /* borrowed */
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "maker: %R is not a slot of %s", name, cls->tp_name);
        return -1;
    }
    PyMemberDef *def = ((PyMemberDescrObject *)descr)->d_member;
    if (def->type != T_OBJECT_EX || (def->flags & READONLY) || def->offset <= 0 ||
        (size_t)def->offset + sizeof(PyObject *) > (size_t)cls->tp_basicsize) {
        PyErr_Format(PyExc_TypeError, "maker: %R of %s is not a writable object slot", name,
                     cls->tp_name);
        return -1;
    }
    return def->offset;
}

static PyObject *
maker_new(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "maker(cls, names, defaults, required)");
        return NULL;
    }
    PyObject *cls = args[0], *names = args[1], *defaults = args[2], *required = args[3];
    if (!PyType_Check(cls) || !PyTuple_Check(names) || !PyTuple_Check(defaults) ||
        PyTuple_GET_SIZE(names) != PyTuple_GET_SIZE(defaults)) {
        PyErr_SetString(PyExc_TypeError,
                        "maker: a class, then two tuples of one length (names, defaults)");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    if (type->tp_alloc == NULL || type->tp_dictoffset != 0) {
        PyErr_Format(PyExc_TypeError, "maker: %s is not a slots class", type->tp_name);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    Maker *m = PyObject_GC_NewVar(Maker, &Maker_Type, n);
    if (m == NULL)
        return NULL;
    m->vectorcall = maker_vectorcall;
    m->n = n;
    m->least = n;
    for (Py_ssize_t i = n - 1; i >= 0 && PyTuple_GET_ITEM(defaults, i) != required; i--)
        m->least = i;
    Py_INCREF(cls);
    m->cls = type;
    Py_INCREF(defaults);
    m->defaults = defaults;
    Py_INCREF(required);
    m->required = required;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= m->least && PyTuple_GET_ITEM(defaults, i) == required) {
            PyErr_SetString(PyExc_TypeError, "maker: a value without a default follows one with");
            Py_DECREF(m);
            return NULL;
        }
        Py_ssize_t off = slot_offset(type, PyTuple_GET_ITEM(names, i));
        if (off < 0) {
            Py_DECREF(m);
            return NULL;
        }
        m->offsets[i] = off;
    }
    PyObject_GC_Track(m);
    return (PyObject *)m;
}

static PyTypeObject Maker_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rankwise._native.Maker",
    .tp_basicsize = sizeof(Maker),
    .tp_itemsize = sizeof(Py_ssize_t),
    .tp_dealloc = maker_dealloc,
    .tp_vectorcall_offset = offsetof(Maker, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_repr = maker_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_traverse = maker_traverse,
    .tp_clear = maker_clear,
};

/* ---- 2. the call-site frame walk ------------------------------------------------------ */

/* The hot half of rankwise.identity.callsite.capture, in C: the frame walk and the cache
 * lookup of a call site seen before. Optional: callsite.py has the same walk in Python
 * and uses it when this module is missing (no compiler at install time) or says
 * "not here" (None): a frame of a file not yet classified, or a chain not cached yet.
 * Why C: the walk is ~0.15 us per frame in Python, ~2 us per call for a stack of 8-10
 * frames, the largest single part of a small device collective's Python
 * (docs/gpu.md, "The proxy"). The rules are callsite._walk's; keep the two the same. */


#define MAX_KEPT 32 /* depth + via, at most: callsite passes 4 + 3 */

#if PY_VERSION_HEX >= 0x030B0000
/* The memo: a chain seen before answers from here, without building and hashing the key
 * tuple of 2 ints per kept frame (capture() 0.85 -> 0.40 us, 8 frames deep, slow machine
 * state). It mirrors the cache dict: filled only from a dict hit, and forgotten when the
 * dict shrinks or another dict comes (see lookup) or by clear().
 * 2-way set-associative, most recent first: a training loop's few hot sites that
 * share a set do not evict each other. It holds strong references to each entry's code
 * objects: a code pointer it compares is never freed and reused by another code object
 * while the entry exists, whatever happens to the dict and callsite._alive. */
#define MEMO_SETS 512 /* power of two; 2 ways each: 1024 chains */
#define MEMO_SHIFT (64 - 9) /* log2(MEMO_SETS): the hash's top bits pick the set */
#define MEMO_KEPT 8 /* longer chains skip the memo (callsite keeps at most 4 + 3) */

typedef struct {
    uint64_t hash;
    PyObject *site; /* strong; NULL: empty */
    int kept;
    int lastis[MEMO_KEPT];
    PyObject *codes[MEMO_KEPT]; /* strong */
} memo_entry;

static memo_entry memo[MEMO_SETS][2];
static PyObject *memo_cache;        /* strong: the dict the memo mirrors */
static Py_ssize_t memo_cache_size; /* its size at the last call: smaller now = cleared */

/* Drops an entry's references after emptying it: a destructor run by a decref (a code
 * object's weakref callback) may call lookup again and must see a consistent table. */
static void
memo_drop(memo_entry *e)
{
    memo_entry old = *e;
    memset(e, 0, sizeof(*e));
    if (old.site == NULL)
        return;
    for (int i = 0; i < old.kept; i++)
        Py_DECREF(old.codes[i]);
    Py_DECREF(old.site);
}

static void
memo_flush(void)
{
    for (int s = 0; s < MEMO_SETS; s++) {
        memo_drop(&memo[s][0]);
        memo_drop(&memo[s][1]);
    }
    PyObject *cache = memo_cache;
    memo_cache = NULL;
    memo_cache_size = 0;
    Py_XDECREF(cache);
}

static uint64_t
chain_hash(void *const *codes, const int *lastis, int kept)
{
    uint64_t h = (uint64_t)kept;
    for (int i = 0; i < kept; i++) {
        h ^= (uint64_t)(uintptr_t)codes[i] >> 4; /* objects are 16-byte aligned */
        h = (h ^ ((uint64_t)(unsigned)lastis[i] << 40)) * 0x9E3779B97F4A7C15ULL;
    }
    return h ^ (h >> 29);
}

static int
chain_equal(const memo_entry *e, uint64_t hash, void *const *codes, const int *lastis,
            int kept)
{
    if (e->site == NULL || e->hash != hash || e->kept != kept)
        return 0;
    for (int i = 0; i < kept; i++)
        if (e->codes[i] != (PyObject *)codes[i] || e->lastis[i] != lastis[i])
            return 0;
    return 1;
}

/* Stores a chain the dict just answered, as the set's most recent entry. */
static void
memo_store(uint64_t hash, void *const *codes, const int *lastis, int kept, PyObject *site)
{
    memo_entry *set = memo[hash >> MEMO_SHIFT];
    memo_entry evicted = set[1];
    set[1] = set[0];
    memo_entry *e = &set[0];
    e->hash = hash;
    e->kept = kept;
    for (int i = 0; i < kept; i++) {
        e->codes[i] = (PyObject *)codes[i];
        Py_INCREF(e->codes[i]); /* alive now: this call's frames hold them */
        e->lastis[i] = lastis[i];
    }
    Py_INCREF(site);
    e->site = site;
    memo_drop(&evicted); /* last: the table is consistent if this runs Python code */
}
#endif

/* lookup(frame, kinds, cache, depth, via, unknown) -> CallSite | None
 *   kinds: {code file name: 0 user, 1 library, 2 skip}; cache: {key tuple: CallSite}.
 *   The key is callsite._walk's: (id(code), f_lasti) of each kept frame, innermost first.
 *   Returns the cached site, ``unknown`` when no frame is kept, None otherwise.
 *   METH_FASTCALL: PyArg_ParseTuple was ~0.25 us of capture()'s 1.1. */
static PyObject *
lookup(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "lookup() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *frame_arg = args[0], *kinds = args[1], *cache = args[2], *unknown = args[5];
    if (!PyDict_Check(kinds) || !PyDict_Check(cache)) {
        PyErr_SetString(PyExc_TypeError, "lookup(): kinds and cache must be dicts");
        return NULL;
    }
    long depth = PyLong_AsLong(args[3]);
    if (depth == -1 && PyErr_Occurred())
        return NULL;
    long most_via = PyLong_AsLong(args[4]);
    if (most_via == -1 && PyErr_Occurred())
        return NULL;
#if PY_VERSION_HEX < 0x030B0000
    (void)frame_arg;
    (void)unknown;
    Py_RETURN_NONE; /* PyFrame_GetLasti is 3.11+: the Python walk serves 3.10 */
#else
    if (!PyFrame_Check(frame_arg))
        Py_RETURN_NONE;
    if (depth <= 0 || most_via < 0 || depth + most_via > MAX_KEPT)
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
        /* the frames being walked are executing: each holds its code object until this
         * call returns, so the pointer stays valid as long as we need it */
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
    /* the memo mirrors one dict: another dict, or this one smaller than at the last call
     * (cleared by callsite.skip_directory or a test), forgets it all */
    Py_ssize_t size = PyDict_GET_SIZE(cache);
    if (cache != memo_cache || size < memo_cache_size) {
        memo_flush();
        PyObject *stale = memo_cache; /* NULL unless a decref in the flush called us */
        Py_INCREF(cache);
        memo_cache = cache;
        Py_XDECREF(stale);
    }
    memo_cache_size = size;
    uint64_t hash = 0;
    if (kept <= MEMO_KEPT) {
        hash = chain_hash(codes, lastis, kept);
        memo_entry *set = memo[hash >> MEMO_SHIFT];
        PyObject *site = NULL;
        if (chain_equal(&set[0], hash, codes, lastis, kept)) {
            site = set[0].site;
        } else if (chain_equal(&set[1], hash, codes, lastis, kept)) {
            memo_entry hit = set[1]; /* most recent first: a move, no reference changes */
            set[1] = set[0];
            set[0] = hit;
            site = hit.site;
        }
        if (site != NULL) {
            Py_INCREF(site);
            return site;
        }
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
    Py_INCREF(site); /* ours before memo_store, whose evictions may run Python code */
    if (kept <= MEMO_KEPT)
        memo_store(hash, codes, lastis, kept, site);
    return site;
#endif
}

/* clear(): forget the memo (callsite calls it wherever it clears its cache; the memo
 * also notices a cleared dict by its size, but not one cleared and refilled between
 * two calls) */
static PyObject *
clear(PyObject *self, PyObject *unused)
{
#if PY_VERSION_HEX >= 0x030B0000
    memo_flush();
#endif
    Py_RETURN_NONE;
}

/* ---- the module ----------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"maker", (PyCFunction)(void (*)(void))maker_new, METH_FASTCALL,
     "maker(cls, names, defaults, required): a constructor of cls that stores its values "
     "and the defaults in the named slots (required: the default of a value with none)"},
    {"lookup", (PyCFunction)(void (*)(void))lookup, METH_FASTCALL,
     "lookup(frame, kinds, cache, depth, via, unknown): the cached call site of the walk "
     "from frame, unknown when no frame is kept, None when the Python walk must run"},
    {"clear", clear, METH_NOARGS,
     "clear(): forget the chains remembered from the cache (call when it is cleared)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "rankwise's optional C helpers: slots dataclasses made without __init__ "
    "(rankwise.slots) and the call-site frame walk (rankwise.identity.callsite).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    if (PyType_Ready(&Maker_Type) < 0)
        return NULL;
    return PyModule_Create(&module);
}
