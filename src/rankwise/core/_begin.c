/* ProcessGroup.begin for the device hot path, in C: the same steps as the Python method
 * (core/group.py), which stays the fallback and the only path while the job has a
 * failure. Why C: a small NCCL all_reduce's host time is rankwise's Python glue, and
 * begin is its largest single piece (two clock reads, the record, the context label,
 * the history) after the view check (docs/gpu.md, "The proxy").
 *
 * begin(new_call, label_var, group, fp, site, dtype, op, shape, frames) returns the
 * call, or None where the Python method must run instead (the router has a failure: it
 * waits for the diagnosis and raises). core/group.py binds the first two. The clocks are the ones Python's time.time()
 * and time.monotonic() read (CLOCK_REALTIME, CLOCK_MONOTONIC). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <time.h>

static PyObject *one;
static PyObject *s_comm, *s_router, *s_failure, *s_seq, *s_timeout, *s_label, *s_history, *s_append,
    *s_register_call, *s_id;

static double
seconds(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static PyObject *
begin(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "begin(new_call, label_var, group, fp, site, dtype, "
                                         "op, shape, frames)");
        return NULL;
    }
    PyObject *group = args[2], *fp = args[3];
    PyObject *comm = PyObject_GetAttr(group, s_comm);
    if (comm == NULL)
        return NULL;
    PyObject *router = PyObject_GetAttr(comm, s_router);
    Py_DECREF(comm);
    if (router == NULL)
        return NULL;
    PyObject *failure = PyObject_GetAttr(router, s_failure);
    if (failure == NULL) {
        Py_DECREF(router);
        return NULL;
    }
    Py_DECREF(failure);
    if (failure != Py_None) {
        Py_DECREF(router);
        Py_RETURN_NONE;
    }
    PyObject *old = PyObject_GetAttr(group, s_seq);
    PyObject *seq = old == NULL ? NULL : PyNumber_Add(old, one);
    Py_XDECREF(old);
    if (seq == NULL) {
        Py_DECREF(router);
        return NULL;
    }
    PyObject *call = NULL, *now = NULL, *deadline = NULL, *label = NULL;
    if (PyObject_SetAttr(group, s_seq, seq) < 0)
        goto done;
    now = PyFloat_FromDouble(seconds(CLOCK_REALTIME));
    if (now == NULL)
        goto done;
    PyObject *timeout = PyObject_GetAttr(group, s_timeout);
    if (timeout == NULL)
        goto done;
    double t = PyFloat_AsDouble(timeout);
    Py_DECREF(timeout);
    if (t == -1.0 && PyErr_Occurred())
        goto done;
    deadline = PyFloat_FromDouble(seconds(CLOCK_MONOTONIC) + t);
    if (deadline == NULL)
        goto done;
    PyObject *values[9] = {group, seq, fp, args[4], args[5], args[6], deadline, now, args[7]};
    call = PyObject_Vectorcall(args[0], values, 9, NULL);
    if (call == NULL)
        goto done;
    if (PyContextVar_Get(args[1], NULL, &label) < 0)
        goto fail;
    if (label != NULL && label != Py_None && PyObject_SetAttr(call, s_label, label) < 0)
        goto fail;
    PyObject *history = PyObject_GetAttr(group, s_history);
    if (history == NULL)
        goto fail;
    PyObject *r = PyObject_CallMethodOneArg(history, s_append, call);
    Py_DECREF(history);
    if (r == NULL)
        goto fail;
    Py_DECREF(r);
    int frames = PyObject_IsTrue(args[8]);
    if (frames < 0)
        goto fail;
    if (frames) {
        PyObject *id = PyObject_GetAttr(group, s_id);
        if (id == NULL)
            goto fail;
        r = PyObject_CallMethodObjArgs(router, s_register_call, id, seq, fp, NULL);
        Py_DECREF(id);
        if (r == NULL)
            goto fail;
        Py_DECREF(r);
    }
    goto done;
fail:
    Py_CLEAR(call);
done:
    Py_XDECREF(label);
    Py_XDECREF(deadline);
    Py_XDECREF(now);
    Py_DECREF(seq);
    Py_DECREF(router);
    return call;
}

static PyMethodDef methods[] = {
    {"begin", (PyCFunction)(void (*)(void))begin, METH_FASTCALL,
     "ProcessGroup.begin's steps for the device hot path (None: run the Python one)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_begin", NULL, -1, methods,
};

PyMODINIT_FUNC
PyInit__begin(void)
{
    if (!(one = PyLong_FromLong(1)) ||
        !(s_comm = PyUnicode_InternFromString("comm")) ||
        !(s_router = PyUnicode_InternFromString("router")) ||
        !(s_failure = PyUnicode_InternFromString("failure")) ||
        !(s_seq = PyUnicode_InternFromString("seq")) ||
        !(s_timeout = PyUnicode_InternFromString("timeout")) ||
        !(s_label = PyUnicode_InternFromString("label")) ||
        !(s_history = PyUnicode_InternFromString("history")) ||
        !(s_append = PyUnicode_InternFromString("append")) ||
        !(s_register_call = PyUnicode_InternFromString("register_call")) ||
        !(s_id = PyUnicode_InternFromString("id")))
        return NULL;
    return PyModule_Create(&module_def);
}
