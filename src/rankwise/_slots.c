/* Making an instance of a slots dataclass without running its Python __init__: the hot
 * half of rankwise.slots.fast_new. Optional: without it fast_new returns the class
 * itself, whose generated __init__ stores the same values in the same slots.
 * Why C: a device collective makes two such records per call (its Call and the watchdog's
 * Pending), and a generated __init__ of 11-19 fields is ~0.5 us of Python each, about a
 * fifth of rankwise's own time on a small NCCL call (docs/gpu.md, "The proxy").
 *
 * maker(cls, names, defaults) checks once that each name is a writable object slot of cls
 * (a member descriptor: slots live at fixed offsets in the instance) and keeps the
 * offsets; calling the maker with the first k values allocates the instance (the class's
 * tp_alloc: zeroed, tracked by the GC) and stores the k values, then the defaults of the
 * rest. A call with keywords is handed to the class itself. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

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
    .tp_name = "rankwise._slots.Maker",
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

static PyMethodDef methods[] = {
    {"maker", (PyCFunction)(void (*)(void))maker_new, METH_FASTCALL,
     "maker(cls, names, defaults, required): a constructor of cls that stores its values "
     "and the defaults in the named slots (required: the default of a value with none)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_slots",
    "Slots dataclasses made without their Python __init__ (optional; see "
    "rankwise.slots).", -1, methods,
};

PyMODINIT_FUNC
PyInit__slots(void)
{
    if (PyType_Ready(&Maker_Type) < 0)
        return NULL;
    return PyModule_Create(&module);
}
